"""`megacli serve`: an OpenAI-compatible HTTP server on a checkpoint, at any TP/PP."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated, Optional

import typer

from megacli.cli.common import TRUST_PICKLE_HELP, SetOpt, guarded
from megacli.cli.root import app


def _opt(help: str, *names: str):
    return typer.Option(*names, help=help, show_default=False)


@app.command(help="Serve a checkpoint over OpenAI's API (/v1/completions, /v1/chat/completions), batching concurrent "
                  "requests (needs megacli[serve]). megacli serve CHECKPOINT [--host 127.0.0.1 --port 8000] [...]")
@guarded
def serve(
    checkpoint: Annotated[Optional[Path], typer.Argument(help="Checkpoint directory; the model and tokenizer come from its recipe.", show_default=False)] = None,
    host: Annotated[Optional[str], _opt("Address to bind (default 127.0.0.1; any other needs an API key).", "--host")] = None,
    port: Annotated[Optional[int], _opt("TCP port (default 8000; 0 = any free port).", "--port")] = None,
    api_key: Annotated[Optional[str], _opt("Key clients must send (Authorization: Bearer KEY); default: $MEGACLI_API_KEY.", "--api-key")] = None,
    model_name: Annotated[Optional[str], _opt("The model's name in the API (default: the checkpoint directory's name).", "--model-name")] = None,
    max_batch: Annotated[Optional[int], _opt("Sequences decoded together (default 16).", "--max-batch")] = None,
    max_queue: Annotated[Optional[int], _opt("Sequences waiting at most before 503 (default 64).", "--max-queue")] = None,
    prefix_cache: Annotated[Optional[bool], typer.Option("--prefix-cache/--no-prefix-cache", show_default=False,
                            help="Reuse the KV cache of prompt prefixes seen before (default: on).")] = None,
    tensor: Annotated[Optional[int], _opt("Tensor-parallel size to run in (default 1).", "--tensor", "-t")] = None,
    pipeline: Annotated[Optional[int], _opt("Pipeline-parallel size to run in (default 1).", "--pipeline")] = None,
    recipe: Annotated[Optional[Path], _opt("YAML recipe with a `serve:` section (flags override it).", "--recipe")] = None,
    trusted: Annotated[bool, typer.Option("--trust-pickle", help=TRUST_PICKLE_HELP)] = False,
    set_: SetOpt = None,
) -> None:
    from megacli.cli.generate import build_recipe, launch_job
    from megacli.errors import UserError

    try:
        import fastapi  # noqa: F401
        import sse_starlette  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError:
        raise UserError("megacli serve needs FastAPI, uvicorn and sse-starlette: pip install 'megacli[serve]'") from None
    flags = {"checkpoint": checkpoint and str(checkpoint), "host": host, "port": port, "model_name": model_name,
             "max_batch": max_batch, "max_queue": max_queue, "prefix_cache": prefix_cache}
    flags = {k: v for k, v in flags.items() if v is not None}
    job = build_recipe(recipe, flags, tensor=tensor, pipeline=pipeline, overrides=set_ or [], job="serve",
                       trusted=trusted)
    if api_key is not None:
        if not api_key.strip():
            raise UserError("--api-key is empty")
        os.environ[job.serve.api_key_env] = api_key  # the workers inherit it; it never enters the recipe
    from megacli.inference.serve.job import api_key as check_key

    check_key(job.serve)  # before the model is loaded
    launch_job(job, "serve")
