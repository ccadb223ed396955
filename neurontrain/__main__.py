from neurontrain.cli import main

raise SystemExit(main())
