"""``python -m deltakv.services.cli ...``: the ``deltakv`` command without the console script."""

import sys

from deltakv.services.cli.main import main

sys.exit(main())
