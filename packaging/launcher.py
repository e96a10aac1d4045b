"""Entry point of the frozen app (packaging/lmsp-tray.spec); `lmsp-tray` / `python -m app` otherwise.

The engine child is started with multiprocessing's spawn method, which in a frozen app runs
this same executable again. freeze_support() recognises such a start and runs the child (or
multiprocessing's resource tracker) and exits — before the app's heavier imports, so an engine
child starts quickly. app.main.main() calls it as well, for any other frozen entry point.
"""

import multiprocessing

multiprocessing.freeze_support()

from app.main import main  # noqa: E402

raise SystemExit(main())
