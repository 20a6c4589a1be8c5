import sys

from statestore.cli import main

sys.exit(main())
