from deja.cli import main

main()
