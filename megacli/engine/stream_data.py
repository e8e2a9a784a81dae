"""On-the-fly training data in the engine: micro-batches from a RankStream, laid out as
GPTDataset's samples, and the stream positions a checkpoint keeps (one per data-parallel rank)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator

import numpy as np
import torch

from megacli.data.stream import RankStream, TokenizerSpec, change, fingerprint
from megacli.engine.batches import to_device
from megacli.errors import UserError


@dataclass
class StreamData:
    """The run's on-the-fly training data; iterators() opens this rank's stream at ``start_state``."""

    data: object  # the recipe's data section
    spec: TokenizerSpec
    tokenizer: object
    seq_length: int
    seed: int
    fim_ids: object = None  # data.fim's token ids (megacli.data.fim.FIMIds), None without FIM
    start_state: dict | None = None
    streams: list | None = None
    _fingerprints: list | None = None

    @property
    def fingerprints(self) -> list[dict]:
        """Each source's fingerprint (megacli.data.stream.fingerprint), taken once."""
        if self._fingerprints is None:
            self._fingerprints = [fingerprint(s) for s in self.data.stream_sources()]
        return self._fingerprints

    def iterators(self, count: int, *, micro_batch_size: int, dp_rank: int, dp_size: int, device) -> list:
        """``count`` iterators over the same micro-batches (one per model chunk)."""
        self.close()
        self.streams = [RankStream(self.data.stream_sources(), spec=self.spec, seq_length=self.seq_length, rank=dp_rank,
                                   world=dp_size, workers=self.data.tokenizer_workers, state=self.start_state)
                        for _ in range(count)]
        return [self._batches(s, micro_batch_size=micro_batch_size, dp_rank=dp_rank, device=device, fim=self.fim_ids)
                for s in self.streams]

    def _batches(self, stream: RankStream, *, micro_batch_size: int, dp_rank: int, device, fim) -> Iterator[dict]:
        d = self.data
        while True:
            samples = []
            for _ in range(micro_batch_size):
                n = stream.samples  # the sample's number on this rank seeds its FIM draws (so a resume redraws them)
                text = next(stream)
                if fim is not None:
                    from megacli.data.fim import fim_sample

                    rng = np.random.RandomState(np.random.SeedSequence([self.seed, dp_rank, n]).generate_state(1))
                    text = fim_sample(text, rng, fim=d.fim, tokenizer=self.tokenizer, ids=fim)
                samples.append(gpt_sample(text, eod=self.tokenizer.eod, pad=getattr(self.tokenizer, "pad", None), data=d))
            batch = {k: torch.stack([s[k] for s in samples]) for k in samples[0]}
            yield to_device(batch, device)

    def state(self) -> dict | None:
        return self.streams[0].state() if self.streams else self.start_state

    def close(self) -> None:
        for s in self.streams or []:
            s.close()
        self.streams = None


def gpt_sample(text: np.ndarray, *, eod: int, pad: int | None, data) -> dict:
    """seq_length + 1 tokens as GPTDataset.__getitem__ gives them (Megatron's own masks and
    positions); with reset_attention_mask, ``segments`` (document number per token) for the step's
    per-document attention mask."""
    from megatron.core.datasets.gpt_dataset import _get_ltor_masks_and_position_ids

    text = torch.from_numpy(np.asarray(text, dtype=np.int64))
    tokens, labels = text[:-1].contiguous(), text[1:].contiguous()
    _, loss_mask, position_ids = _get_ltor_masks_and_position_ids(
        tokens, eod, data.reset_position_ids, data.reset_attention_mask, data.eod_mask_loss, False)
    if pad is not None:
        loss_mask[labels == pad] = 0.0
        tokens[tokens == pad] = 0
        labels[labels == pad] = 0
    sample = {"tokens": tokens, "labels": labels, "loss_mask": loss_mask, "position_ids": position_ids}
    if data.reset_attention_mask:  # an EOD belongs to the document it ends
        sample["segments"] = torch.cumsum(tokens == eod, 0) - (tokens == eod).long()
    return sample


def gathered_states(stream: StreamData) -> list:
    """Every data-parallel rank's stream position, in rank order (collective over the DP group)."""
    from megatron.core import parallel_state as ps

    states = [None] * ps.get_data_parallel_world_size()
    torch.distributed.all_gather_object(states, stream.state(), group=ps.get_data_parallel_group())
    return states


def resumed_state(stream: StreamData, meta: dict, *, checkpoint, dp_rank: int, dp_size: int) -> tuple[dict | None, list[str]]:
    """This rank's position from a checkpoint's megacli.json, and notes; refused when a source
    changed since the checkpoint unless data.restart_changed_sources (then those start over)."""
    state = state_of_rank(meta.get("stream"), dp_rank=dp_rank, dp_size=dp_size)
    saved = meta.get("stream_sources")
    if state is None or saved is None:  # saved without fingerprints: nothing to compare
        return state, []
    now = stream.fingerprints
    mixture = bool(stream.data.sources)
    if not isinstance(saved, list):
        changed = {None: "the checkpoint's record of the sources is unreadable"}
    elif len(saved) != len(now):
        changed = {None: f"data.sources has {len(now)} sources, the checkpoint's run read {len(saved)}"}
    else:
        changed = {i: why for i, (old, new) in enumerate(zip(saved, now)) if (why := change(old, new))}
    if not changed:
        return state, []
    named = {i: f"{f'data.sources[{i}]' if mixture else 'data'}: {why}" if i is not None else why
             for i, why in changed.items()}
    if not stream.data.restart_changed_sources:
        raise UserError(f"{next(iter(named.values()))}: the on-the-fly data changed since checkpoint {checkpoint}, and "
                        f"its saved position (documents read, tokens used) would be applied to other documents. Restore "
                        f"the data, or set data.restart_changed_sources: true to read the changed sources from their "
                        f"first document")
    if None in changed:
        return None, [f"{named[None]}: every source read from its first document (data.restart_changed_sources)"]
    notes = [f"{why}: read from its first document (data.restart_changed_sources)" for why in named.values()]
    positions = [{} if i in changed else p for i, p in enumerate(state["positions"])]
    return {**state, "positions": positions}, notes


def state_of_rank(saved: list | None, *, dp_rank: int, dp_size: int) -> dict | None:
    """This rank's position from a checkpoint's list (None: the checkpoint has none, start over)."""
    if saved is None:
        return None
    if len(saved) != dp_size:
        raise UserError(f"the checkpoint's on-the-fly data position was saved by {len(saved)} data-parallel ranks; "
                        f"this run has {dp_size}: each rank's documents differ, so resume with the same data-parallel size")
    return saved[dp_rank]
