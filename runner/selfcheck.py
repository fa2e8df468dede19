"""``python -m runner.selfcheck``: the GPU self-check, a row per claim (runner/bench/selfcheck/)."""

from __future__ import annotations


def main(argv: list[str] | None = None) -> int:
    from runner.bench.selfcheck import main as selfcheck

    return selfcheck(argv)


if __name__ == "__main__":
    raise SystemExit(main())
