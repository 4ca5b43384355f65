import sys

from dsv_jax.cli import main

sys.exit(main())
