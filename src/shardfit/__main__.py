from shardfit.cli import main

raise SystemExit(main())
