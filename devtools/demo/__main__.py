"""`python -m devtools.demo`: run the demo (see `devtools.demo.app`)."""

from __future__ import annotations

from devtools.demo.app import main

if __name__ == "__main__":
    raise SystemExit(main())
