from marlaas.cli.main import app

app(prog_name="marlaas")
