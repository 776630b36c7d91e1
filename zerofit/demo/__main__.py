from zerofit.demo import write_data

print(f"wrote {write_data()}")
