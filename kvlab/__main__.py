from kvlab.cli import main

raise SystemExit(main())
