"""`python -m tests.scripted_app '<Script as JSON>' --headless ...`: the app as `python -m app`
runs it, but its local engines are scripted (tests/scripted.py), for the tests that need the app
as a process of its own (a SIGKILL, its log, its exit) and not llama.cpp's inference."""

import functools
import json
import sys

from app import main
from tests import scripted

if __name__ == "__main__":
    script = scripted.Script(**json.loads(sys.argv.pop(1)))
    main.AppService = functools.partial(main.AppService, engine_factory=scripted.factory(script))  # type: ignore[misc]
    raise SystemExit(main.main())
