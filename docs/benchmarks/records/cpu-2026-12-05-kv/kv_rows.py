import torch
torch.set_num_threads(1)
from meshserve.parallel.planner.calibration import kv_row_seconds
dev = torch.device("cpu")
for shape in ((4, 32), (8, 32), (2, 64), (4, 64), (8, 64), (2, 128), (4, 128), (8, 128)):
    t = kv_row_seconds(dev, 5, *shape)
    r = 2*shape[0]*shape[1]*4
    print(shape, r, "ns/row %.1f  GB/s %.1f" % (t*1e9, r/t/1e9))
