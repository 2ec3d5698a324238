from nam56r_bench.cli import main

raise SystemExit(main())
