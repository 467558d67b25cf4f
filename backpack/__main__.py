"""`python -m backpack`: the tour; `python -m backpack verify MODULE:FACTORY` checks your model.

See `backpack.tour` and `backpack.verification`.
"""

import sys

if __name__ == "__main__":
    if sys.argv[1:2] == ["verify"]:
        from backpack.verification import main as verify_main

        raise SystemExit(verify_main(sys.argv[2:]))
    from backpack.tour import main

    raise SystemExit(main())
