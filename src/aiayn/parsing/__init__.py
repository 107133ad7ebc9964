"""English constituency parsing (section 6.3): Penn Treebank trees as translation pairs.

`trees` reads, cleans, linearizes and de-linearizes trees (the GAFL target of Vinyals et
al. 2015); `ptb` reads the treebank, splits it and writes the words / linearized-tree
files that translation's `prepare` reads.

Punctuation tags of decoded trees: `delinearize` tags each word by its form (EVALB's
COLLINS.prm deletes words by their tag, so a decoded tree must tag punctuation as the gold
one does). Measured on NLTK's WSJ sample (3,914 trees, 94,084 words): of the 10,729 words
whose gold tag is one EVALB deletes (, : `` '' .), the word form alone gives the gold tag
to 10,718 (99.90%), and `punctuation_tags` (`'` closing an open "`" is '') to 10,727
(99.98%); the two left are "Wa" tagged ',' and a nested quote's closing `'`. Of the 11,777
words the table covers, it agrees with 11,767 by form alone and 11,776 in context; `'` is
POS 63 times and '' 10 times (9 of them after an open "`").
"""
