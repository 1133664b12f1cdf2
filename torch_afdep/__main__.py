"""``python -m torch_afdep <command>``.

Commands:
    doctor   check this machine's setup and run a tiny self-test exchange
             (``--json``, ``--verbose``, ``--no-selftest``; see torch_afdep/tools/doctor.py)
    demo     the main job: a small AFD MoE layer through the exchange
             (same options as ``python -m torch_afdep.demo``)
"""

from __future__ import annotations

import sys

COMMANDS = ("doctor", "demo")


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(__doc__.strip())
        return 0 if argv else 2
    cmd, rest = argv[0], argv[1:]
    if cmd == "doctor":
        from .tools.doctor import main as doctor_main

        return doctor_main(rest)
    if cmd == "demo":
        from .tools.demo import main as demo_main

        return demo_main(rest)
    print(f"python -m torch_afdep: unknown command {cmd!r}; choose one of "
          f"{', '.join(COMMANDS)}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
