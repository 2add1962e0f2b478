from examples.wikitext2.train import main

main()
