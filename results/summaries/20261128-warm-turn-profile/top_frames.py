import sys, collections
for f in sys.argv[1:]:
    threads=collections.Counter(); leaf=collections.Counter(); incl=collections.Counter(); idle=0
    for line in open(f):
        stack, _, n = line.rstrip().rpartition(' '); n=int(n)
        frames = stack.split(';')
        th = frames[0]
        if 'idle' in line.lower() and False: pass
        threads[th]+=n
        leaf[frames[-1][:110]]+=n
        for fr in set(frames[1:]): incl[fr[:110]]+=n
    print('=====',f, sum(threads.values()))
    for t,n in threads.most_common(12): print(n, t[:100])
    print('-- top leaf'); [print(n,l) for l,n in leaf.most_common(25)]
