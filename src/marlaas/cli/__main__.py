from marlaas.cli.main import run

run()
