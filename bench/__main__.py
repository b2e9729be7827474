import sys

from bench.router_bench import main

sys.exit(main())
