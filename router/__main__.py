import sys

from router.service import main

sys.exit(main())
