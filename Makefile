# The two commands of the README's quick start. Extra overrides: make run ARGS="nodes=2"
.PHONY: run test lint
run:
	scripts/run.sh $(ARGS)
test:
	scripts/test.sh $(ARGS)
lint:
	scripts/bootstrap.sh test
	.venv/bin/ruff check hpc_ddp tests
	.venv/bin/mypy hpc_ddp
