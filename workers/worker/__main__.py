from workers.worker.process import main

main()
