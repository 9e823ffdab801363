from hvdkit.cli import main

raise SystemExit(main())
