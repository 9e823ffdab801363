import sys

from hvdkit.cli import main

raise SystemExit(main(["build-horovod", *sys.argv[1:]]))
