"""A real OpenAI-compatible upstream for the remote-endpoint tests: llama-cpp-python's own
server (llama_cpp.server), with the model loaded in llama.cpp's safe mode (`--fast`: fast).

    python -m tests.upstream --model PATH --port N [--model-alias NAME] [--n-threads 1] [--fast]

Why not `python -m llama_cpp.server`: with our portable wheel (GGML_BACKEND_DL) nothing loads
the CPU backend ("no backends are loaded"), and it has no setting for llama.cpp's
`use_extra_bufts`: on CPUs whose AMX kernels crash (SIGILL on this Sapphire Rapids) the model
must load without extra buffer types. The app's engine does both (backend.load(),
extra_bufts(False)); the server loads its one model inside create_app, so building the app
inside extra_bufts(False) is enough."""

from __future__ import annotations

import argparse

import uvicorn
from llama_cpp.server.app import create_app
from llama_cpp.server.settings import ModelSettings, ServerSettings

from app.engine.child import backend
from app.engine.child.main import extra_bufts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="the GGUF file")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--model-alias", help="the name /v1/models lists (default: the file's path)")
    parser.add_argument("--n-threads", type=int, default=1, help="two upstreams share two cores in the tests")
    parser.add_argument("--n-ctx", type=int, default=2048)
    parser.add_argument("--interrupt-requests", action=argparse.BooleanOptionalAction, default=True,
                        help="the server's default: a new request ends the stream in progress")
    parser.add_argument("--api-key", help="then every request needs `Authorization: Bearer <it>` (else 401)")
    parser.add_argument("--fast", action="store_true",
                        help="llama.cpp's extra buffer types on, as the engine's fast mode (a benchmark's peer)")
    args = parser.parse_args()
    model = ModelSettings(model=args.model, model_alias=args.model_alias, n_ctx=args.n_ctx,
                          n_threads=args.n_threads, n_threads_batch=args.n_threads, verbose=False)
    backend.load()
    with extra_bufts(args.fast):
        app = create_app(server_settings=ServerSettings(host="127.0.0.1", port=args.port,
                                                        interrupt_requests=args.interrupt_requests,
                                                        api_key=args.api_key),
                         model_settings=[model])
    uvicorn.run(app, host="127.0.0.1", port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
