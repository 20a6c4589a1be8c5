import sys

from dataserver.cli import main

sys.exit(main())
