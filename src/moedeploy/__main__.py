"""The `moedeploy` command's entry point (and `python -m moedeploy`).

Importing the CLI takes seconds (torch, onnx, the server's modules); a Ctrl-C in that time
arrived before any of moedeploy's code could catch it and printed a traceback. Here the import
itself is guarded, so an early Ctrl-C reads like a late one: `interrupted`, exit 130.
Before that import the process may start itself again with glibc's huge-page tunable set
(moedeploy/utils/huge_pages.py: a decode step's weights in 2 MB pages).
"""

from __future__ import annotations

import sys


def main() -> None:
    try:
        from moedeploy.utils.huge_pages import restart_with_huge_pages

        restart_with_huge_pages()
        from moedeploy.cli import main as cli_main
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        sys.exit(130)
    cli_main()


if __name__ == "__main__":
    main()
