"""``python -m sagecupy``: the ``sagecupy`` command line (:mod:`sagecupy.cli`)."""
from .cli import main

if __name__ == "__main__":
    main()
