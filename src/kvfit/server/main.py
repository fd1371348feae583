"""``kvfit serve``: the OpenAI-compatible server in the foreground.

``add_serve_args(parser)`` adds --host/--port/--served-model-name/--log-level plus every engine
flag (from EngineConfig); ``main(argv)`` parses, starts the engine thread and uvicorn, and
returns 0 after a graceful shutdown (SIGTERM or Ctrl-C: stop accepting, abort in flight, stop
the engine).
"""

from __future__ import annotations

import argparse
import logging
import signal
from typing import Optional

from kvfit.config import add_engine_args, config_from_args


def add_serve_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument("--host", default="127.0.0.1",
                        help="address to bind (default: 127.0.0.1; 0.0.0.0 for every interface)")
    parser.add_argument("--port", type=int, default=8000, help="port to bind (default: 8000)")
    parser.add_argument("--served-model-name", default=None,
                        help="model name clients use and responses carry (default: --model)")
    parser.add_argument("--log-level", default="info",
                        choices=["critical", "error", "warning", "info", "debug"],
                        help="server log level (default: info)")
    parser.add_argument("--engine-mode", default="process", choices=["process", "thread"],
                        help="run the engine in its own process (default; keeps HTTP work off "
                             "the engine's critical path) or in a thread of the server process")
    add_engine_args(parser)
    return parser


def main(argv: Optional[list[str]] = None) -> int:
    parser = add_serve_args(argparse.ArgumentParser(
        prog="kvfit serve", description="OpenAI-compatible HTTP server over the kvfit engine"))
    args = parser.parse_args(argv)
    if not 0 <= args.port <= 65535:
        parser.error(f"--port must be in [0, 65535], got {args.port}")
    try:
        config = config_from_args(args)
    except (TypeError, ValueError) as e:
        parser.error(str(e))
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger().setLevel(args.log_level.upper())  # also when `kvfit` set up logging
    from kvfit.server.launch import engine_launch_kwargs, make_server

    name = args.served_model_name or config.model
    logging.getLogger("kvfit.server").info(
        "starting: loading %s in the background (config, tokenizer, weights, KV cache); "
        "http://%s:%d/health answers 503 until the 'engine ready' line", config.model,
        args.host, args.port)
    server = make_server(served_model_name=name, host=args.host, port=args.port,
                         log_level=args.log_level, aliases=(config.model,),
                         **engine_launch_kwargs(config, args.engine_mode == "process"))
    # uvicorn re-raises the signal it caught once it has shut down; a SIGTERM handler of ours
    # turns that into a normal return, so a graceful stop exits 0.
    terminated = []
    previous = signal.signal(signal.SIGTERM, lambda sig, frame: terminated.append(sig))
    try:
        server.run()
    except KeyboardInterrupt:
        pass
    except SystemExit as e:  # uvicorn exits this way when it cannot bind
        if e.code not in (0, None):
            return int(e.code) if isinstance(e.code, int) else 1
    finally:
        signal.signal(signal.SIGTERM, previous)
        server.engine_loop.shutdown()
    if not server.started:
        logging.getLogger("kvfit.server").error("the server did not start (see above)")
        return 1
    if server.engine_loop.error and not terminated:
        return 1
    return 0


if __name__ == "__main__":  # python -m kvfit.server.main
    import sys

    sys.exit(main(sys.argv[1:]))
