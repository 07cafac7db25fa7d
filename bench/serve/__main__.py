from bench.serve.cli import main

main()
