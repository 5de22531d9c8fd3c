from .demo import main

main()
