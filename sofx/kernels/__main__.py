"""``python -m sofx.kernels``: build the native CPU library where needed and say what the kernels are here
(:mod:`sofx.kernels.report`)."""

import sys

from sofx.kernels.report import main

sys.exit(main())
