"""``python -m fusion_pass demo [options]``: see ``fusion_pass.demo``."""

import sys


def main() -> int:
    if len(sys.argv) < 2 or sys.argv[1] not in ("demo",):
        print("usage: python -m fusion_pass demo [--device cpu|cuda] [--layers N] [--batch B] [--seq S]")
        return 2
    from fusion_pass.demo import main as demo

    return demo(sys.argv[2:])


if __name__ == "__main__":
    sys.exit(main())
