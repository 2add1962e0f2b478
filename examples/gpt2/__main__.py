from examples.gpt2.train import main

main()
