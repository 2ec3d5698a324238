from nam56r.bench.cli import main

raise SystemExit(main())
