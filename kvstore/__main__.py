from kvstore.cli import main

raise SystemExit(main())
