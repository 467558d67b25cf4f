"""`python -m backpack`: the tour (see `backpack.tour`)."""

from backpack.tour import main

if __name__ == "__main__":
    raise SystemExit(main())
