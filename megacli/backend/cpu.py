"""CPU backend: run Megatron-Core's real (CUDA-written) code paths on CPU tensors with gloo.

Megatron-Core assumes CUDA in a few dozen places that have nothing to do with the maths: it creates
bookkeeping tensors with ``device="cuda"`` or ``device=torch.cuda.current_device()``, calls
``Tensor.cuda()``, compares ``Tensor.type()`` with ``'torch.cuda.FloatTensor'``, drives the CUDA RNG
through ``torch.cuda`` for its model-parallel RNG tracker and calls ``torch.cuda.synchronize``.
``enable()`` bridges exactly those, so that the same schedules, p2p communication, DDP grad
buffers, optimizers and dist-checkpointing run on CPU with a gloo process group.

Nothing happens at import (Megatron's async checkpoint writer starts processes with ``spawn``,
which re-imports modules); ``enable()`` is explicit, idempotent, and never called on a CUDA run.
It is meant for a CPU-only torch build: ``torch.cuda.is_available()`` keeps returning False, so
Megatron takes its non-CUDA branches (no Transformer Engine, no straggler detector, no CUDA graphs,
no NCCL-only features) - none of the code paths used for training needs it to say True.

What ``enable()`` changes, and why (one line each):

* a ``TorchFunctionMode`` (``CudaToCpu``) pushed on the enabling thread, which in every torch call
    - rewrites a CUDA ``device=`` (``"cuda"``, ``"cuda:N"``, ``torch.device("cuda")``, a bare int)
      to ``cpu``: Megatron allocates buffers, flags and masks with ``device="cuda"``;
    - rewrites a CUDA target of ``Tensor.to(...)`` to ``cpu``: same, for moves;
    - drops ``pin_memory=True``: a CPU-only build has no pinned allocator, and Megatron pins
      host staging tensors (e.g. the context-parallel RoPE index in ``get_pos_emb_on_this_cp_rank``);
    - turns tensor split sizes of ``torch.distributed.all_to_all_single`` into lists: Megatron's MoE
      all-to-all dispatcher copies its split sizes to the host as NumPy arrays, a step that leaves
      tensors already on the CPU as they are, and the collective takes no tensor;
    - does a ``torch.distributed.all_gather`` into tensors of unequal sizes (NCCL's does; gloo's
      takes equal sizes only) as an equal one of tensors zero-padded to the largest, each then cut
      back: Megatron-Core's layer-wise distributed optimizer (Muon's) gathers every rank's updated
      parameters, whole matrices, flattened into one tensor a rank;
    - makes ``Tensor.cuda()`` return the tensor itself: optimizer and checkpoint code call it;
    - makes ``Tensor.type()`` of a CPU tensor answer ``'torch.cuda.<T>Tensor'`` (and accepts such
      names as a cast target): Megatron's optimizers reject parameters whose ``type()`` is not one
      of the ``torch.cuda.*Tensor`` strings.
* ``torch.autograd.graph._engine_run_backward`` (and its alias in ``torch.autograd``) -> runs the
  autograd engine with the mode pushed: ``torch.autograd.backward`` is itself dispatched through
  the mode, and a mode's handler runs with the mode popped, so without this every backward
  function, grad hook and activation recompute (a whole forward re-run inside backward) would
  see no mode and fail on ``device="cuda"``. (torch.compiler patches the same two names.)
* ``torch.cuda.current_device()`` -> ``torch.device("cpu")``: it is a plain function (no mode can
  intercept it), it raises on a CPU build, and ``device=torch.cuda.current_device()`` is how
  Megatron spells "the device" - in backward functions too (e.g. the sequence-parallel
  reduce-scatter buffer).
* ``torch.cuda.synchronize()`` -> no-op: CPU kernels are synchronous; p2p, schedules, DDP and
  checkpointing call it.
* ``torch.cuda.get_rng_state / set_rng_state / manual_seed`` (also under ``torch.cuda.random``)
  -> the CPU default generator: on CPU the "device generator" is the CPU generator, the one dropout
  draws from, so Megatron's RNG tracker forks the right stream (per-TP-rank dropout inside
  ``get_cuda_rng_tracker().fork()``, shared dropout outside it) and recompute replays it.
* ``torch.cuda.default_generators`` -> an indexable that returns the CPU default generator for any
  index: the tracker's ``_set_cuda_rng_state`` indexes it by device.
* ``torch.cuda.Stream``, ``Event``, ``current_stream``, ``default_stream`` and ``stream(...)`` ->
  stand-ins where waiting, recording and synchronising do nothing and the stream context is empty:
  CPU kernels run in order on the calling thread. Megatron's MoE all-to-all token dispatcher
  creates a side stream for its device-to-host copies when it is built, and syncs on an event
  recorded on it every forward.
* ``megatron.core.tensor_parallel.random._lazy_call`` -> call now: Megatron imported
  ``torch.cuda._lazy_call``, which on a CPU build queues the call until CUDA initialises, i.e.
  forever - every RNG state restore (tracker fork exit, recompute) would be silently dropped.
* a filter on the ``megatron.core.tensor_parallel.random`` logger dropping "CPU RNG state changed
  within GPU RNG context": with one generator that is true by construction for every fork that
  draws numbers, and it would be logged on every dropout call.

* Megatron-Core imported with ``torch.compile`` as the identity and wandb hidden (when
  ``enable()`` is the first to import it): its fusion modules call ``torch.compile`` at import,
  which loads torch._dynamo (about 2 CPU-seconds a process) for kernels a CPU run never compiles
  (the fused functions run eagerly), and its inference context imports wandb (0.8 CPU-s) to log.

Left alone on purpose: ``torch.cuda.is_available()`` stays False (nothing on the CPU training
path needs True, and False keeps Megatron off TE, CUDA graphs, NCCL-only and straggler-detector
code); ``torch.cuda.device_count()`` stays 0; ``torch.cuda.memory_*`` already answer 0 on a CPU
build. Gloo's ``all_to_all_single`` (with uneven splits, as the MoE dispatcher uses it) exists for
CPU tensors, so expert parallelism needs no collective bridged.

Consequences the caller must know:

* **Seeding for identical weights across tensor-parallel ranks.** With
  ``TransformerConfig(use_cpu_initialization=True)`` every TP rank draws the *full* master weight
  from torch's CPU generator and keeps its slice, so that generator must be in the same state on
  every rank of a TP group when the model is built. Call ``seed_all(seed)`` and then
  ``model_parallel_cuda_manual_seed(seed)`` with the same ``seed`` on every rank (on this backend
  the latter also reseeds the CPU generator, with its data-parallel seed, which is ``seed``) and
  build the model right after, drawing nothing rank-dependent in between. With
  ``use_cpu_initialization=False`` the partitioned weights are drawn inside
  ``get_cuda_rng_tracker().fork()`` from a per-TP-rank seed, as on CUDA. Either way the weights
  depend on the pipeline layout (each stage draws only its own layers), as they do on CUDA.
* ``Tensor.type()`` without arguments answers ``torch.cuda.*`` for CPU tensors to everyone on the
  enabling thread; ``.device``, ``.is_cuda`` and ``isinstance`` checks stay truthful.
* The mode is pushed on the thread that calls ``enable()``; call ``enable()`` from the main
  thread before building anything. Code on other threads still gets the ``torch.cuda``
  replacements and runs backward under the mode, but otherwise needs ``cpu_device_mode()``.
* Megatron's *persistent* async checkpoint worker is a spawned process (it does not inherit
  these patches) that calls ``torch.cuda.set_device(rank % torch.cuda.device_count())``; use
  synchronous saves or the default (forked) async caller on CPU.
"""

from __future__ import annotations

import contextlib
import logging
import threading

__all__ = ["enable", "is_enabled", "seed_all", "cpu_device_mode"]

_enabled = False
_lock = threading.Lock()
_mode = None  # the TorchFunctionMode instance pushed by enable(); kept so it is never collected
_mode_cls = None
_RNG_WARNING = "CPU RNG state changed within GPU RNG context"


def is_enabled() -> bool:
    """True once ``enable()`` has run in this process."""
    return _enabled


def enable() -> None:
    """Patch torch (and Megatron's RNG module) so Megatron-Core runs on CPU. Idempotent."""
    global _enabled, _mode, _mode_cls
    with _lock:
        if _enabled:
            return
        import torch

        import_megatron(torch)
        mode_cls = _make_mode_class(torch)
        _patch_torch_cuda(torch)
        _patch_autograd_engine(torch, mode_cls)
        _patch_megatron_random()
        _mode_cls = mode_cls
        _mode = mode_cls()
        _mode.__enter__()  # stays pushed for the life of the process (this thread)
        _enabled = True


def seed_all(seed: int) -> None:
    """Seed the CPU generator (which, with the backend enabled, is also "the CUDA generator") and
    Python's ``random``/numpy, identically on every rank that passes the same ``seed``: the first
    half of the recipe for identical master weights on all tensor-parallel ranks (see the module
    docstring); ``model_parallel_cuda_manual_seed(seed)`` follows, then the model is built."""
    import random

    import torch

    random.seed(seed)
    try:
        import numpy as np

        np.random.seed(seed % 2**32)
    except ImportError:  # pragma: no cover - numpy is a dependency
        pass
    torch.manual_seed(seed)


@contextlib.contextmanager
def cpu_device_mode():
    """The device-rewriting mode, for a thread other than the one that called ``enable()``."""
    if not _enabled:
        raise RuntimeError("megacli.backend.cpu.enable() has not been called")
    with _mode_cls():
        yield


@contextlib.contextmanager
def device_rewriting_paused():
    """Pop the device-rewriting mode for code that creates no CUDA tensors by name (an inference
    forward: its buffers come from ``torch.cuda.current_device()``, which stays patched). Every
    torch call through the mode pays a Python dispatch - about half of a decode step's time on a
    small model. A no-op when the backend is not enabled (CUDA runs)."""
    if not _enabled:
        yield
        return
    from torch.overrides import _get_current_function_mode, _pop_mode_temporarily

    if not isinstance(_get_current_function_mode(), _mode_cls):
        yield
        return
    with _pop_mode_temporarily():
        yield


# --------------------------------------------------------------------------------------------
# torch.cuda replacements


class _CpuGenerators:
    """Stands in for ``torch.cuda.default_generators``: one device, the CPU default generator,
    whatever index (int, ``torch.device``, None) it is asked for."""

    def __init__(self, torch):
        self._gen = torch.default_generator

    def __getitem__(self, idx):
        if isinstance(idx, slice):
            return (self._gen,)[idx]
        return self._gen

    def __len__(self):
        return 1

    def __iter__(self):
        return iter((self._gen,))


class _CpuEvent:
    """Stands in for ``torch.cuda.Event``: CPU work is already complete when it is recorded."""

    def record(self, stream=None):
        return None

    def synchronize(self):
        return None

    def wait(self, stream=None):
        return None

    def query(self) -> bool:
        return True


class _CpuStream:
    """Stands in for ``torch.cuda.Stream``: one in-order CPU "stream", nothing to wait for."""

    def __init__(self, device=None, priority=0, **kwargs):
        self.device = device
        self.priority = priority

    def wait_stream(self, stream):
        return None

    def wait_event(self, event):
        return None

    def record_event(self, event=None):
        return event if event is not None else _CpuEvent()

    def synchronize(self):
        return None

    def query(self) -> bool:
        return True


def _patch_torch_cuda(torch) -> None:
    cuda = torch.cuda
    cuda_random = torch.cuda.random
    cpu = torch.device("cpu")
    gen = torch.default_generator

    def current_device():
        return cpu

    def synchronize(device=None):
        return None

    def get_rng_state(device="cuda"):
        return gen.get_state()

    def set_rng_state(new_state, device="cuda"):
        gen.set_state(new_state)

    def manual_seed(seed):
        gen.manual_seed(int(seed))

    cuda.current_device = current_device
    cuda.synchronize = synchronize
    for mod in (cuda, cuda_random):
        mod.get_rng_state = get_rng_state
        mod.set_rng_state = set_rng_state
        mod.manual_seed = manual_seed
    cuda.default_generators = _CpuGenerators(torch)
    the_stream = _CpuStream()
    cuda.Stream = _CpuStream
    cuda.Event = _CpuEvent
    cuda.current_stream = lambda device=None: the_stream
    cuda.default_stream = lambda device=None: the_stream
    cuda.stream = lambda stream=None: contextlib.nullcontext()


def _patch_autograd_engine(torch, mode_cls) -> None:
    import torch.autograd.graph as graph
    from torch.overrides import _get_current_function_mode_stack

    run = graph._engine_run_backward

    def _engine_run_backward(*args, **kwargs):
        if any(isinstance(m, mode_cls) for m in _get_current_function_mode_stack()):
            return run(*args, **kwargs)
        with mode_cls():
            return run(*args, **kwargs)

    graph._engine_run_backward = _engine_run_backward
    torch.autograd._engine_run_backward = _engine_run_backward


def import_megatron(torch) -> None:
    """Import Megatron-Core as a CPU run needs it (``enable()`` does; a process that imports it
    ahead of a run does too): with ``torch.compile`` as the identity and without wandb. Its fusions
    are decorated with ``jit_fuser`` (``torch.compile``) when their modules are imported, and each
    decoration loads torch._dynamo: about 2 CPU-seconds in every process, for kernels a CPU run
    never compiles (the fused functions then run as plain eager code, the same maths). Its
    dynamic-inference context imports wandb when installed (0.8 CPU-s) for logging megacli never
    asks of it; wandb stays importable afterwards for megacli's own tracker."""
    import sys

    if "megatron.core" in sys.modules:
        return
    compile_ = torch.compile
    hide_wandb = "wandb" not in sys.modules

    def identity(model=None, **kwargs):
        return model if model is not None else (lambda fn: fn)

    torch.compile = identity
    # A CUDA build of torch without a GPU (PyPI's only builds for Python 3.12): Megatron-Core's RNG
    # module imports torch.utils.cpp_extension, which warns at import that no CUDA runtime is found.
    cpp_extension_log = logging.getLogger("torch.utils.cpp_extension")
    cpp_extension_level = cpp_extension_log.level
    cpp_extension_log.setLevel(logging.ERROR)
    if hide_wandb:
        sys.modules["wandb"] = None  # an import of it raises ImportError
    try:
        import megatron.core.models.gpt  # noqa: F401 - the modules that decorate fusions
    except ImportError:  # Megatron absent: nothing to import
        pass
    finally:
        torch.compile = compile_
        cpp_extension_log.setLevel(cpp_extension_level)
        if hide_wandb:
            del sys.modules["wandb"]


def _patch_megatron_random() -> None:
    try:
        import megatron.core.tensor_parallel.random as mrandom
    except ImportError:  # Megatron absent: nothing of it to patch
        return
    mrandom._lazy_call = lambda fn, **kwargs: fn()

    class _DropSharedGeneratorWarning(logging.Filter):
        def filter(self, record):
            return _RNG_WARNING not in record.getMessage()

    logging.getLogger(mrandom.__name__).addFilter(_DropSharedGeneratorWarning())


# --------------------------------------------------------------------------------------------
# device rewriting


def _make_mode_class(torch):
    from torch.overrides import TorchFunctionMode

    cpu = torch.device("cpu")
    Tensor = torch.Tensor
    tensor_cuda = Tensor.cuda
    tensor_type = Tensor.type
    tensor_to = Tensor.to
    import torch.distributed as dist

    all_to_all_single = getattr(dist, "all_to_all_single", None)
    all_gather = getattr(dist, "all_gather", None)

    def is_cuda(dev) -> bool:
        if isinstance(dev, torch.device):
            return dev.type == "cuda"
        if isinstance(dev, str):
            return dev.startswith("cuda")
        # a bare int device index means a CUDA device to torch
        return isinstance(dev, int) and not isinstance(dev, bool)

    class CudaToCpu(TorchFunctionMode):
        """Rewrite CUDA devices to CPU in torch calls (see module docstring)."""

        def __torch_function__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            if func is tensor_cuda:
                return args[0]
            if func is tensor_type:
                self_t = args[0]
                if len(args) == 1 and "dtype" not in kwargs:
                    name = func(self_t)
                    if self_t.device.type == "cpu" and name.startswith("torch."):
                        return "torch.cuda." + name[len("torch."):]
                    return name
                target = args[1] if len(args) > 1 else kwargs.get("dtype")
                if isinstance(target, str) and target.startswith("torch.cuda."):
                    target = "torch." + target[len("torch.cuda."):]
                    return func(self_t, target, *args[2:], **{k: v for k, v in kwargs.items() if k != "dtype"})
                return func(*args, **kwargs)
            dev = kwargs.get("device")
            if dev is not None and is_cuda(dev):
                kwargs = {**kwargs, "device": cpu}
            if kwargs.get("pin_memory"):
                kwargs = {**kwargs, "pin_memory": False}
            if func is tensor_to and len(args) > 1 and is_cuda(args[1]) and not isinstance(args[1], Tensor):
                args = (args[0], cpu) + tuple(args[2:])
            if func is all_to_all_single:
                kwargs = {k: v.tolist() if isinstance(v, Tensor) and k.endswith("split_sizes") else v
                          for k, v in kwargs.items()}
            if func is all_gather and _unequal_gather(*args, **kwargs):
                return _padded_all_gather(*args, **kwargs)
            return func(*args, **kwargs)

    def _unequal_gather(tensor_list, tensor, group=None, async_op=False) -> bool:
        return not async_op and len({t.numel() for t in tensor_list}) > 1

    def _padded_all_gather(tensor_list, tensor, group=None, async_op=False) -> None:
        size = max(t.numel() for t in tensor_list)
        padded = [tensor.new_zeros(size) for _ in tensor_list]
        all_gather(padded, torch.cat([tensor.reshape(-1), tensor.new_zeros(size - tensor.numel())]), group=group)
        for out, got in zip(tensor_list, padded):
            out.copy_(got[:out.numel()].view_as(out))

    return CudaToCpu
