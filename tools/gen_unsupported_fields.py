"""Write docs/unsupported-fields.md from the field status tables (megatron_bridge/config/status.py)."""

from __future__ import annotations

import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOC = os.path.join(REPO, "docs", "unsupported-fields.md")


def main() -> int:
    sys.path.insert(0, REPO)
    from megatron_bridge.config.field_catalog import unsupported_markdown

    with open(DOC, "w", encoding="utf-8") as fh:
        fh.write(unsupported_markdown())
    print(f"wrote {os.path.relpath(DOC, REPO)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
