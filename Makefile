# The two commands of the README's quick start. Extra overrides: make run ARGS="nodes=2"
.PHONY: run test lint bench-docs
run:
	scripts/run.sh $(ARGS)
test:
	scripts/test.sh $(ARGS)
lint:
	scripts/bootstrap.sh test
	.venv/bin/ruff check hpc_ddp tests
	.venv/bin/mypy hpc_ddp
# Every benchmark the docs show, run as documented (minutes each; docs/testcluster.md).
bench-docs:
	scripts/test.sh -n 0 -m docbench tests/cluster/test_doc_benchmarks.py $(ARGS)
