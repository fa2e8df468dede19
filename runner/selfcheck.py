"""``python -m runner.selfcheck``: the GPU self-check, a row per claim (runner/bench/selfcheck/)."""

from __future__ import annotations

from runner.common.errors import EXIT_USER_ERROR  # the standard library's alone


def main(argv: list[str] | None = None) -> int:
    try:
        from runner.bench.selfcheck import main as selfcheck
    except ModuleNotFoundError as e:  # a node without one of the project's dependencies
        if not e.name or e.name.split(".")[0] == "runner":
            raise
        print(f"missing the project's dependencies {e.name}: bring them as wheels (docs/gpu.md, "
              "'Self-check on an offline GPU node') and run again")
        return EXIT_USER_ERROR
    return selfcheck(argv)


if __name__ == "__main__":
    raise SystemExit(main())
