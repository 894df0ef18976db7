import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

STORIES = os.path.join(ROOT, "tests", "fixtures", "stories260K")
# the read-only shared/ folder that sits beside the checkout (and beside CI's clone)
SHARED = os.path.normpath(os.path.join(ROOT, "..", "shared"))
if not os.path.isdir(SHARED):  # a clone made elsewhere (e.g. /tmp) on the development machine
    SHARED = "/work/shared"
# Golden greedy continuation of "Once upon a time" (tests/fixtures/stories260K/README.md)
STORIES_GOLDEN = (", there was a little girl named Lily. She loved to play outside in the park. "
                  "One day, she saw a big, red ball. She wanted to play with it, but it was too "
                  "high.")


@pytest.fixture(scope="session")
def stories_path():
    return STORIES
