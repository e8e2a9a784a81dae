"""`megacli reshard --verify` / `reshard verify`: every entry of a written checkpoint against what
its plan says it must hold (blake2b of every global tensor reassembled box by box, the objects,
the common state), as a report."""

from __future__ import annotations

import io
import time
from dataclasses import dataclass
from pathlib import Path

from megacli.checkpoint.layout import META
from megacli.checkpoint.megacli_checkpoint import OPT_PREFIX, RNG_KEY, Checkpoint
from megacli.checkpoint.safe_pickle import torch_load
from megacli.checkpoint.space import size_text
from megacli.checkpoint.torch_dist import is_extra_state
from megacli.errors import UserError
from megacli.reshard.digest import Digest, bytes_digest, object_digest
from megacli.reshard.tensor_plan import Plan


@dataclass
class VerifyReport:
    tensors: int
    objects: int
    bytes: int
    mismatches: list[str]
    seconds: float

    @property
    def ok(self) -> bool:
        return not self.mismatches

    def line(self) -> str:
        if self.ok:
            return (f"verify: OK - {self.tensors} tensors ({size_text(self.bytes)}), {self.objects} objects and the common "
                    f"state match the source (blake2b of every reassembled global tensor, {self.seconds:.1f} s)")
        first = "; ".join(self.mismatches[:3]) + (f"; and {len(self.mismatches) - 3} more" if len(self.mismatches) > 3 else "")
        return f"verify: FAILED - {len(self.mismatches)} mismatch(es): {first}"


def verify_plan(plan: Plan, it_dir: Path, progress=None) -> VerifyReport:
    """The checkpoint written from ``plan`` at ``it_dir`` (read with its source's trust) against the plan."""
    return verify_against(plan, Checkpoint(plan.source.source.at(it_dir)), progress)


def verify_against(plan: Plan, tgt: Checkpoint, progress=None) -> VerifyReport:
    """Compare every entry of ``tgt`` with what ``plan`` says it must hold."""
    start = time.perf_counter()
    mismatches: list[str] = []
    reader = tgt.reader
    want_t = {t.key: t for t in plan.tensors}
    want_o = {o.key: o for o in plan.objects}
    weights_only = (any(k.startswith(OPT_PREFIX) for k in want_t)
                    and not any(k.startswith(OPT_PREFIX) for k in reader.tensors))
    if weights_only:  # one line, not one per optimizer tensor, RNG object and the data position
        mismatches.append(f"{tgt.path} has no optimizer state (weights only): its weights were compared, not the "
                          f"source's optimizer state, RNG state and data position")
        want_t = {k: t for k, t in want_t.items() if not k.startswith(OPT_PREFIX)}
        want_o = {k: o for k, o in want_o.items() if not (RNG_KEY.match(k) and k not in reader.objects)}
    mismatches += _entry_mismatches(plan, tgt, want_t, want_o, weights_only)

    done = progress("verifying", len(want_t) + len(want_o)) if progress else (lambda key: None)
    nbytes = 0
    for key, entry in want_t.items():
        if key in reader.tensors:
            problem, compared = _tensor_mismatch(reader, key, entry)
            if problem is not None:
                mismatches.append(problem)
            nbytes += compared
        done(key)
    for key, entry in want_o.items():
        if key in reader.objects:
            problem = _object_mismatch(reader, key, entry)
            if problem is not None:
                mismatches.append(problem)
        done(key)
    try:
        if not weights_only and object_digest(tgt.common) != object_digest(plan.common):
            mismatches.append("common.pt (optimizer param groups / scheduler) differs")
    except UserError as exc:
        mismatches.append(str(exc))
    return VerifyReport(tensors=len(want_t), objects=len(want_o), bytes=nbytes, mismatches=mismatches,
                        seconds=time.perf_counter() - start)


def _entry_mismatches(plan: Plan, tgt: Checkpoint, want_t: dict, want_o: dict, weights_only: bool) -> list[str]:
    """Entries missing from or unexpected in ``tgt``, and its iteration, data position and layout."""
    reader = tgt.reader
    mismatches = [f"{key} missing" for key in sorted(set(want_t) - set(reader.tensors))]
    mismatches += [f"{key} unexpected" for key in sorted(set(reader.tensors) - set(want_t))]
    # A module's extra state that records nothing (None, empty) is the same as none stored: a
    # local-spec checkpoint stores none where a TE-spec one stores empty ones.
    for key in sorted(set(want_o) - set(reader.objects)):
        if not (is_extra_state(key) and _records_nothing(lambda: torch_load(
                io.BytesIO(want_o[key].produce()), trust=reader.source.trust, name=f"the planned {key}"))):
            mismatches.append(f"{key} missing")
    for key in sorted(set(reader.objects) - set(want_o)):
        if not (is_extra_state(key) and _records_nothing(lambda: reader.read_object(key))):
            mismatches.append(f"{key} unexpected")
    for k in ("iteration",) if weights_only else ("iteration", "consumed_samples"):
        if tgt.meta.get(k) != plan.source.meta.get(k):
            mismatches.append(f"{META} {k} {tgt.meta.get(k)} != {plan.source.meta.get(k)}")
    if tgt.layout != plan.target.layout:
        mismatches.append(f"{META} layout {tgt.layout} != {plan.target.layout}")
    return mismatches


def _tensor_mismatch(reader, key: str, entry) -> tuple[str | None, int]:
    """(what differs between a stored tensor and the planned one, None when they match; the bytes
    compared, 0 when it could not be read whole)."""
    info = reader.tensors[key]
    if info.shape != tuple(entry.shape) or info.dtype != entry.dtype:
        return f"{key}: {info.shape} {info.dtype}, expected {tuple(entry.shape)} {entry.dtype}", 0
    covered = sum(_volume(sizes) for _, sizes in info.chunks)
    if covered != _volume(info.shape):
        return f"{key}: stored chunks cover {covered} of {_volume(info.shape)} elements", 0
    # The global tensor, reassembled box by box (the target's stored chunks, in order) on both sides.
    want, got = Digest(), Digest()
    try:
        for offsets, sizes in sorted(info.chunks):
            got.update(reader.read_region(key, offsets, sizes))
            want.update(entry.region(offsets, sizes))
    except UserError as exc:
        return str(exc), 0
    return (f"{key}: checksum differs" if got.hexdigest() != want.hexdigest() else None), info.nbytes


def _object_mismatch(reader, key: str, entry) -> str | None:
    """What differs between a stored object and the planned one; None when they match."""
    try:
        extra = is_extra_state(key)
        if RNG_KEY.match(key) or extra:
            got, want = reader.read_object(key), torch_load(io.BytesIO(entry.produce()), trust=reader.source.trust,
                                                            name=f"the planned {key}")
            if extra:
                # Transformer Engine's FP8 bookkeeping, not weights: compared where both sides
                # record some (a local-spec checkpoint records none for a TE-spec one's).
                got, want = _extra_state(got), _extra_state(want)
            ok = got is None or want is None or object_digest(got) == object_digest(want)
        else:
            ok = bytes_digest(reader.read_object_bytes(key)) == bytes_digest(entry.produce())
    except UserError as exc:
        return str(exc)
    except Exception as exc:  # noqa: BLE001 - undecodable bytes
        return f"{key}: cannot decode ({type(exc).__name__})"
    return None if ok else f"{key}: checksum differs"


def _records_nothing(read) -> bool:
    try:
        return _extra_state(read()) is None
    except UserError:
        return False


def _extra_state(stored):
    """A module's stored extra state, None where it records nothing (None, an empty tensor or buffer)."""
    import torch

    (value,) = stored if isinstance(stored, list) and len(stored) == 1 else (stored,)
    if value is None or (isinstance(value, torch.Tensor) and value.numel() == 0):
        return None
    if isinstance(value, io.BytesIO):
        return value.getvalue() or None
    return stored


def _volume(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n
