"""The `make demo` package: failure -> localization -> recovery on one CPU machine.

    python examples/resiliency_demo.py [--out demo-output]

Modules:
  scenario    the model, the data, the lm-resiliency configuration and the built-in campaign
  worker      one training rank (plain PyTorch loop + `enable_resiliency` + `enable_fault_injection`)
  supervisor  launches the 4 ranks per generation, watches them, relaunches after a failure
  report      scoring, the final table, the report JSON, the bitwise check and the timeline PNG
  cli         the command line (`examples/resiliency_demo.py` calls `cli.main`)

See docs/fault_injection.md, "Demo".
"""
