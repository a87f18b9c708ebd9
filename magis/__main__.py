from magis.cli import main

main()
