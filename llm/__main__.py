"""`zerollm` and `python -m llm`: the command line (`llm.cli`), imported here so that a Ctrl-C while its modules
load ends the command as one during it does (`zerollm: interrupted`, exit 130), not as an import traceback."""

import sys


def run() -> None:
    try:
        from llm.cli import main  # noqa: PLC0415 - inside the try: a Ctrl-C while it loads
    except KeyboardInterrupt:
        print("zerollm: interrupted", file=sys.stderr)
        sys.exit(130)
    main()


if __name__ == "__main__":
    run()
