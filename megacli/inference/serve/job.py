"""The serve job: the checkpoint loaded on every rank of its TP/PP layout; rank 0 runs the HTTP
server (uvicorn) and the batching loop, and every rank runs the loop's cache calls in lockstep.

SIGTERM (uvicorn's handler on rank 0) stops accepting connections and lets the requests in flight
finish for serve.shutdown_timeout seconds; then whatever still runs is cancelled, the other ranks
are released and the job returns (exit 0). The other ranks ignore SIGTERM: rank 0 ends them.
"""

from __future__ import annotations

import os
import signal
import threading
from pathlib import Path

from megacli.engine import distributed
from megacli.errors import UserError
from megacli.recipe.serve import LOOPBACK

IDLE_PING_SECONDS = 30.0  # an idle loop pings the other ranks (their broadcast waits must not time out)


def api_key(serve) -> str | None:
    """The API key (from serve.api_key_env), or None; a UserError for a non-loopback host without one."""
    key = os.environ.get(serve.api_key_env) or None
    if key is None and serve.host not in LOOPBACK:
        raise UserError(f"serve.host = {serve.host!r}: serving on an address other than loopback needs an API key "
                        f"(--api-key KEY, or the environment variable {serve.api_key_env})")
    return key


def masked(key: str) -> str:
    return f"{key[:3]}…({len(key)} characters)" if len(key) > 8 else "…"


def chat_template(recipe):
    """messages -> prompt text by the chat template of the checkpoint's tokenizer (for a finetuned
    model, the one it was trained with: megacli.checkpoint.carried), rendered by transformers in its
    sandbox; None when the tokenizer has none."""
    from megacli.data.sft import chat_template_of, render_chat

    template = chat_template_of(recipe.tokenizer.path)
    if template is None:
        return None
    return lambda messages: render_chat(messages, template)


IO_CORES = 1  # on CPU: one core kept from the model's torch threads for the HTTP side


def run(recipe, *, on_ready=None) -> None:
    # The event loop, tokenizer and streaming run beside every decoding step; a torch thread pool
    # over every core stalls at each op's barrier whenever they take one of its cores.
    with distributed.running(parallel=recipe.parallel, launch=recipe.launch, seed=recipe.generate.seed,
                             cores_kept=IO_CORES) as runtime:
        serve(recipe, runtime, on_ready=on_ready)


def serve(recipe, runtime, *, on_ready=None) -> None:
    """Serve until SIGTERM/SIGINT (or, from a test, ``on_ready(server)``'s caller setting
    ``server.should_exit``). ``on_ready`` is called on rank 0 once the port is bound."""
    from megacli.data.tokenizers import load_tokenizer
    from megacli.inference.lockstep import Lockstep
    from megacli.inference.runner import Model
    from megacli.inference.serve.prefix_cache import PrefixCache
    from megacli.inference.serve.slots import Slots, check_servable
    from megacli.plan import model_vocab_size

    s = recipe.serve
    key = api_key(s)
    tok = load_tokenizer(type=recipe.tokenizer.type, path=recipe.tokenizer.path, vocab_size=recipe.model.vocab_size)
    model = Model(recipe, runtime, vocab_size=model_vocab_size(recipe, tok))
    check_servable(model)
    context = recipe.model.max_positions
    prefix = PrefixCache(block=s.prefix_block, max_blocks=s.prefix_cache_blocks) if s.prefix_cache else None
    slots = Slots(model, max_batch=s.max_batch, capacity=s.cache_length or 2 * context, prefix=prefix)
    lockstep = Lockstep(slots, world_size=runtime.world_size)
    if runtime.rank != 0:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        lockstep.follow()
        return
    try:
        _serve_http(recipe, model, tok, lockstep, key=key, on_ready=on_ready)
    finally:
        lockstep.stop()
    _record_stop(recipe.run.dir)


def _record_stop(run_dir: str) -> None:
    """Tell the launcher (which passed the signal on) that the workers stopped as asked."""
    import json

    from megacli.rundir import STOPPED_FILE

    Path(run_dir).mkdir(parents=True, exist_ok=True)
    (Path(run_dir) / STOPPED_FILE).write_text(json.dumps({"reason": "signal", "job": "serve"}) + "\n")


def _serve_http(recipe, model, tok, lockstep, *, key, on_ready) -> None:
    import uvicorn

    from megacli.inference.generator import Generator
    from megacli.inference.serve.app import Served, build_app
    from megacli.inference.serve.batcher import Batcher, Metrics
    from megacli.inference.serve.grammar import Grammars

    s, g = recipe.serve, recipe.generate
    stop_ids = set(g.stop_tokens) | ({tok.eod} if g.stop_at_eod and tok.eod is not None else set())
    stopper = {}  # the uvicorn server, once made: a failed model stops it (the job then exits non-zero)
    batcher = Batcher(lockstep, tok, max_batch=s.max_batch, max_queue=s.max_queue, stop_ids=stop_ids,
                      metrics=Metrics(cache=lockstep.work), idle_seconds=IDLE_PING_SECONDS,
                      prefill_tokens=s.prefill_tokens,
                      on_fatal=lambda: setattr(stopper["server"], "should_exit", True))
    name = s.model_name or Path(str(recipe.generate.checkpoint)).resolve().name
    served = Served(name=name, generator=Generator(model, tok, g), context=recipe.model.max_positions, batcher=batcher,
                    default_max_tokens=s.max_tokens, api_key=key, chat_template=chat_template(recipe),
                    shutdown_grace=s.shutdown_timeout,
                    grammars=Grammars(recipe.tokenizer.path if recipe.tokenizer.type == "huggingface" else None,
                                      model.vocab_size))
    config = uvicorn.Config(build_app(served), host=s.host, port=s.port, log_level="warning", access_log=False,
                            timeout_graceful_shutdown=s.shutdown_timeout, lifespan="off")
    server = stopper["server"] = uvicorn.Server(config)
    loop_thread = threading.Thread(target=batcher.run, name="megacli-serve-batcher", daemon=True)
    loop_thread.start()
    started = threading.Thread(target=_announce, args=(server, name, key, on_ready), daemon=True)
    started.start()
    if threading.current_thread() is threading.main_thread():
        # uvicorn handles SIGTERM/SIGINT while it runs, then raises them again for the handlers it
        # found: these, so that a graceful stop ends the job normally (exit 0)
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: None)
    try:
        server.run()
    finally:
        batcher.cancel_all()
        batcher.stop()
        loop_thread.join(timeout=60)
    if batcher.error is not None:
        raise batcher.error


def _announce(server, name: str, key: str | None, on_ready) -> None:
    """Once uvicorn has bound its socket: say where, and call on_ready."""
    import time

    while not server.started:
        if server.should_exit:
            return
        time.sleep(0.02)
    sock = server.servers[0].sockets[0].getsockname()
    host = f"[{sock[0]}]" if ":" in sock[0] else sock[0]
    note = f" (API key {masked(key)} required)" if key else ""
    print(f"serving {name!r} at http://{host}:{sock[1]}/v1{note}", flush=True)
    if on_ready is not None:
        on_ready(server)
