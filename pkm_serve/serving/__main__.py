import sys

from pkm_serve.serving.server import main

sys.exit(main())
