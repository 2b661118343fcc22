import sys

from pkm_serve.serving import main

sys.exit(main())
