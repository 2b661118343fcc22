"""`python -m pkm_serve.export SRC DST ...` (same as `pkm-serve export`)."""
import sys

from pkm_serve.export.exporter import main

sys.exit(main())
