from zerofit.cli import main

raise SystemExit(main())
