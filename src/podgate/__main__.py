from podgate.cli.main import main

main()
