"""``python -m server``: start Eyrie (see ``server.args`` for the flags)."""

import sys

from server.launch import main

if __name__ == "__main__":
    sys.exit(main())
